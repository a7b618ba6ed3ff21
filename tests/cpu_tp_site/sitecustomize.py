"""Test-only: lets SGLang 0.5.23's CPU engine run ``--tp-size 2`` and ``--pp-size 2`` (tests/test_sglang_tp_server.py,
tests/test_sglang_pp_server.py).

That engine's model-parallel groups default to a PyNccl communicator, built for
the CPU device, and stop every server with more than one rank with "Expected a
cuda device, but got: cpu" (``parallel_state.init_model_parallel_group``:
``use_pynccl`` is on unless the platform is an out-of-tree one without NCCL;
the in-tree CPU platform is not).  Its all-reduces then go through the gloo
groups it builds anyway.  On a GPU SGLang is used as it is: this folder is put
on ``PYTHONPATH`` only by those tests, for their CPU servers, and does nothing
unless ``SGLANG_USE_CPU_ENGINE=1``.
"""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    try:
        import sglang.srt.distributed.parallel_state as _parallel_state
    except ImportError:   # not a server process of this venv
        _parallel_state = None
    if _parallel_state is not None:
        _init_group = _parallel_state.init_model_parallel_group

        def init_model_parallel_group(*args, **kwargs):
            if kwargs.get("use_pynccl") is None:
                kwargs["use_pynccl"] = False
            return _init_group(*args, **kwargs)

        _parallel_state.init_model_parallel_group = init_model_parallel_group
