"""Storage tiers behind one interface (base.py), one module per medium, found by registry.py."""
