"""Engine integrations: connectors that let inference engines store and load KV through kvtier."""
