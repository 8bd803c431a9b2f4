"""SGLang-protocol rollout: client, fleet, embedded engine and server."""
