"""SGLang glue: the only code of the project that imports SGLang (pinned sglang==0.5.23).

* ``plugin``   entry point: registers every hook and the attention backend
* ``args``     ``--kv-cache-dtype oscar-int2``, ``--oscar-*`` flags, backend choice
* ``settings`` launch settings carried to subprocesses, artifact loading (no SGLang)
* ``memory``   KV dtype, pool sizing and pool construction hooks
* ``sizing``   byte math of the INT2 pool and its hot side pool (no SGLang)
* ``hot``      ownership of the BF16 hot side pool entries (no SGLang)
* ``pool``     the INT2 token-to-KV pool
* ``backend``  the ``oscar_int2`` attention backend

Nothing is imported here, so loading the entry point costs nothing until SGLang calls it.
"""
