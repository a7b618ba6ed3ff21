"""Launch settings travel to subprocesses through the environment and come back unchanged (no SGLang needed)."""

from pathlib import Path

import pytest

from oscar_sglang.sglang import settings as st


def test_settings_round_trip_through_the_environment():
    env = {}
    st.LaunchSettings(Path("/r"), sink=4, recent=16, hot_requests=8).export(env)
    assert env == {st.ENV_ROTATIONS: "/r", st.ENV_SINK: "4", st.ENV_RECENT: "16", st.ENV_HOT_REQUESTS: "8"}
    assert st.LaunchSettings.from_env(env) == st.LaunchSettings(Path("/r"), 4, 16, 8)
    # unset overrides are removed, not left over from an earlier launch
    st.LaunchSettings(Path("/r")).export(env)
    assert env == {st.ENV_ROTATIONS: "/r"}
    assert st.LaunchSettings.from_env(env) == st.LaunchSettings(Path("/r"))


def test_settings_refuse_bad_values():
    with pytest.raises(st.OscarConfigError, match="oscar-calibrate --model MODEL --out DIR"):
        st.LaunchSettings.from_env({})
    with pytest.raises(st.OscarConfigError, match="is not an integer"):
        st.LaunchSettings.from_env({st.ENV_ROTATIONS: "/r", st.ENV_SINK: "four"})
    with pytest.raises(st.OscarConfigError, match="must be >= 0"):
        st.LaunchSettings.from_env({st.ENV_ROTATIONS: "/r", st.ENV_HOT_REQUESTS: "-2"})


def test_kv_budget_knob():
    assert st.kv_budget_bytes({}) is None
    assert st.kv_budget_bytes({st.ENV_KV_BUDGET: "1073741824"}) == 2**30
    with pytest.raises(st.OscarConfigError, match="must be > 0"):
        st.kv_budget_bytes({st.ENV_KV_BUDGET: "0"})


def test_graph_hot_update_knob():
    assert st.graph_hot_update({}) == "graph"
    assert st.graph_hot_update({st.ENV_GRAPH_HOT_UPDATE: "eager"}) == "eager"
    with pytest.raises(st.OscarConfigError, match="expected one of graph, eager"):
        st.graph_hot_update({st.ENV_GRAPH_HOT_UPDATE: "later"})


def test_extend_kernel_knob():
    assert st.extend_kernel_options({}) == {} and st.extend_kernel_options({st.ENV_EXTEND_KERNEL: " "}) == {}
    assert st.extend_kernel_options({st.ENV_EXTEND_KERNEL: "block_rows=128, block_n=64,num_warps=4,num_stages=3,"
                                                            "dots=tf32"}) == \
        {"block_rows": 128, "block_n": 64, "num_warps": 4, "num_stages": 3, "dots": "tf32"}
    for bad, match in (("block_rows", "KEY=VALUE"), ("tile=64", "KEY=VALUE"),
                       ("block_n=32,block_n=64", "each key once"), ("block_rows=96", "power of two"), ("num_warps=0", "power of two"),
                       ("num_stages=-1", "positive integer"), ("dots=fp16", "one of bf16, tf32")):
        with pytest.raises(st.OscarConfigError, match=match):
            st.extend_kernel_options({st.ENV_EXTEND_KERNEL: bad})
    # the other path: the prefix dequantized, then torch SDPA (kernels.api.extend_attention(backend="sdpa"))
    assert st.extend_kernel_options({st.ENV_EXTEND_KERNEL: " sdpa"}) == {"backend": "sdpa"}
    assert st.extend_kernel_options({st.ENV_EXTEND_KERNEL: "kernel "}) == {"backend": "kernel"}
    for bad in ("sdpa,dots=tf32", "SDPA", "backend=sdpa", "kernel,dots=tf32"):
        with pytest.raises(st.OscarConfigError, match="; or sdpa, or kernel$"):
            st.extend_kernel_options({st.ENV_EXTEND_KERNEL: bad})


def test_extend_path_is_sdpa_on_cuda_unless_the_knob_asks_for_the_kernel():
    env = st.ENV_EXTEND_KERNEL
    assert st.extend_path("cuda", {}) == ("sdpa", {})                        # the default on a GPU
    assert st.extend_path("cpu", {}) == (None, {})                           # the pool's kernels (torch on CPU)
    assert st.extend_path("cpu", {env: "sdpa"}) == ("sdpa", {})
    assert st.extend_path("cuda", {env: "kernel"}) == (None, {})             # the Triton kernel, its defaults
    assert st.extend_path("cuda", {env: "dots=tf32,block_n=64"}) == (None, {"dots": "tf32", "block_n": 64})
    with pytest.raises(st.OscarConfigError):
        st.extend_path("cuda", {env: "flash"})


def test_decode_kernel_knob():
    assert st.decode_kernel_options({}) == {}
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "block_n=64,num_warps=8, num_stages=3"}) == \
        {"block_n": 64, "num_warps": 8, "num_stages": 3}
    # the loop's variants (the first H200 run's loop: prefetch=0,hot_skip=0)
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "prefetch=0,hot_skip=0,dots=bf16"}) == \
        {"prefetch": 0, "hot_skip": False, "dots": "bf16"}
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "hot_skip=1,prefetch=2"}) == {"hot_skip": True,
                                                                                         "prefetch": 2}
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "fold=1"}) == {"fold": True}
    # the compiler's register bound (any integer the PTX .maxnreg takes, not a power of two)
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "fold=1,num_warps=2,max_registers=168"}) == \
        {"fold": True, "num_warps": 2, "max_registers": 168}
    # the split count for one whole wave of this many resident programs (decode_variants' "Grids" table)
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "resident=6"}) == {"resident": 6}
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "hot_loop=1"}) == {"hot_loop": True}
    # the splits cut evenly (0) or by work with a window's block weighing this many quarters of a cold block
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "hot_weight=0"}) == {"hot_weight": 0}
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "fold=1,hot_weight=24"}) == {"fold": True, "hot_weight": 24}
    assert st.decode_kernel_options({st.ENV_DECODE_KERNEL: "fold=1,num_warps=2,unpack_first=1"}) == \
        {"fold": True, "num_warps": 2, "unpack_first": True}
    # unset or "auto": the loop timed at a CUDA server's startup (kernels/decode/autotune.py); "default": not
    for value, options, timed in ((None, {}, True), ("auto", {}, True), (" auto ", {}, True), ("default", {}, False),
                                  ("fold=1", {"fold": True}, False)):
        env = {} if value is None else {st.ENV_DECODE_KERNEL: value}
        assert (st.decode_kernel_options(env), st.decode_kernel_autotuned(env)) == (options, timed)
    keys = "block_n, num_warps, num_stages, max_registers, resident, hot_weight, dots, prefetch, hot_skip, fold, hot_loop, " \
        "unpack_first; " \
        "or auto, or default$"
    for bad, match in (("block_rows=64", "KEY=VALUE, each key once, of " + keys), ("sdpa", "of " + keys),
                       ("auto,fold=1", "of " + keys),
                       ("block_n=8", "power of two >= 16"), ("dots=fp16", "dots='fp16', expected one of tf32, bf16"),
                       ("prefetch=3", "expected one of 0, 1, 2"), ("hot_skip=yes", "expected one of 0, 1"),
                       ("fold=true", "expected one of 0, 1"), ("unpack_first=2", "expected one of 0, 1"),
                       ("block_n=48", "power of two >= 16"), ("num_warps=3", "power of two"),
                       ("max_registers=8", "within 16..255"), ("max_registers=256", "within 16..255"),
                       ("max_registers=-1", "within 16..255"), ("resident=0", "within 1..64"),
                       ("resident=65", "within 1..64"), ("hot_weight=2", r"within 0..64 \(0, or 4 and more\)"),
                       ("hot_weight=65", "within 0..64")):
        with pytest.raises(st.OscarConfigError, match=match):
            st.decode_kernel_options({st.ENV_DECODE_KERNEL: bad})


def test_kernel_knob_keys_are_the_kernels_own():
    # settings keeps its own copy of the keys and choices (it is imported before any
    # kernel, and a CPU server never imports Triton); this pins them to the kernels'.
    import inspect

    from oscar_sglang.kernels.decode import triton_kernel as decode_kernel
    from oscar_sglang.kernels.extend import triton_kernel

    params = inspect.signature(triton_kernel.extend_attention).parameters
    assert st.EXTEND_DOTS == triton_kernel.DOT_CHOICES and triton_kernel.DOTS in st.EXTEND_DOTS
    assert all(isinstance(params[key].default, int) for key in st.EXTEND_INT_KEYS)
    from oscar_sglang.kernels import api

    assert st.EXTEND_SDPA in api.EXTEND_BACKENDS
    params = inspect.signature(decode_kernel.decode_attention).parameters
    assert all(isinstance(params[key].default, int) for key in st.DECODE_INT_KEYS
               if key not in st._INT_RANGES and key != "block_n")
    assert params["block_n"].default is None  # unset: the head size's (default_block_n), a power of two >= 16
    assert all(decode_kernel.default_block_n(d) in (16, 32, 64) for d in (64, 128, 256, 512))
    assert params["max_registers"].default is None  # unset: the compiler's own choice
    assert params["resident"].default is None  # unset: the fixed 8 warps per multiprocessor
    assert params["hot_weight"].default is None  # unset: the loop's own weight (split_cut.py)
    # the knob's hot_weight rule (0, or a cold block's 4 quarters up to the most) is the kernel's (split_cut.check_cut)
    from oscar_sglang.kernels.decode import split_cut

    assert st._INT_RANGES["hot_weight"] == (0, split_cut.MAX_HOT_WEIGHT) and split_cut.COLD_WEIGHT == 4
    assert all(key in params for key in st._INT_RANGES)
    assert st.DECODE_CHOICES["dots"] == decode_kernel.DOT_CHOICES
    assert {key: type(params[key].default) for key in ("prefetch", "hot_skip", "fold", "hot_loop", "unpack_first")} == \
        {"prefetch": int, "hot_skip": bool, "fold": bool, "hot_loop": bool, "unpack_first": bool}
    assert set(st.DECODE_CHOICES) - {"dots"} <= set(params)


def test_server_env_passes_the_environment_knobs_not_a_launch_s_settings():
    from oscar_sglang.sglang import launcher

    outer = {st.ENV_ROTATIONS: "/r", st.ENV_SINK: "4", "TRITON_INTERPRET": "1", "PATH": "/bin",
             st.ENV_EXTEND_KERNEL: "dots=tf32", st.ENV_DECODE_KERNEL: "block_n=64", st.ENV_KV_BUDGET: "1024",
             st.ENV_GRAPH_HOT_UPDATE: "eager", "OSCAR_SGLANG_CACHE": "/c"}
    assert launcher.server_env(cpu=True, environ=outer) == {
        "PATH": "/bin", st.ENV_EXTEND_KERNEL: "dots=tf32", st.ENV_DECODE_KERNEL: "block_n=64",
        st.ENV_KV_BUDGET: "1024", st.ENV_GRAPH_HOT_UPDATE: "eager", "OSCAR_SGLANG_CACHE": "/c",
        "SGLANG_USE_CPU_ENGINE": "1"}
