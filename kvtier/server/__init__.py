"""``kvtier server``: one cache per host, shared by many engine processes."""
