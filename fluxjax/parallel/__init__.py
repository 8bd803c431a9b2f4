"""The parallel training layer: batch packing, strategies, Ulysses, sync, the step."""
