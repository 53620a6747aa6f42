"""Storage tiers behind one interface (base.py), one module per medium, built by factory.py."""
