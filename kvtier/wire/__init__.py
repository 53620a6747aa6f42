"""What travels between ``kvtier.client`` and ``kvtier server``: the message protocol and the
shared-memory arena. Both ends import this package; neither imports the other."""
