"""Exception types a caller may want to tell apart."""


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value, flag or adapter description is invalid."""


class ObjectError(KvtierError):
    """A stored KV object cannot be used; it must be treated as a miss."""


class BadMagic(ObjectError):
    """The bytes are not a kvtier object at all."""


class UnsupportedVersion(ObjectError):
    """The object was written by an object format this version cannot read."""


class Truncated(ObjectError):
    """The buffer is shorter than its header says."""


class ChecksumMismatch(ObjectError):
    """The payload does not match its checksum: corrupted in storage or transit."""


class LayoutMismatch(ObjectError):
    """The object was made for another model or KV layout (fail closed)."""


class KeyMismatch(ObjectError):
    """The object is stored under a key other than its own (a foreign object)."""


class UnknownCodec(ObjectError):
    """The object's codec id is not known to this build."""
