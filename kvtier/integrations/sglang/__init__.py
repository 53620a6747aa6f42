"""kvtier as SGLang's HiCache storage backend (the third tier of SGLang's hierarchical cache),
loaded by SGLang's ``dynamic`` backend factory:

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang.storage", "class_name": "KvtierStorage",
        "kvtier.url": "tcp://127.0.0.1:5555"}'

``config`` reads the ``kvtier.*`` keys, ``pools`` binds each host pool SGLang registers to a
kvtier namespace and copies its pages, ``storage`` is the backend (the only module that imports
SGLang). docs/sglang.md has the flags, what runs where and how tenants are kept apart.
"""
