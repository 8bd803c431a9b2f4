"""The mesh, the logical axis names and the rules that map them onto it."""
