"""scripts/profile_jax_cycle.py's kernel_sources, on a module XLA dumped on the CPU: each fusion named by the kinds of
op in it and the specdec lines they come from."""

import inspect
import os
import re
import subprocess
import sys

from specdec.models import gemma_jax
from tests.scripts import load_script


def test_kernel_sources_name_a_fusions_ops_and_specdec_lines(tmp_path):
    code = ("import jax, jax.numpy as jnp\nfrom specdec.models.gemma_jax import _gelu\n"
            "jax.jit(lambda x, y: (_gelu(x) * 2, _gelu(y) * 3, jnp.argmax(x)))(jnp.ones(8), jnp.ones(16))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    module = max(tmp_path.glob("*after_optimizations.txt"), key=lambda path: path.stat().st_size).read_text()
    kernels = [name.replace(".", "_") for name in re.findall(r"^\s*(?:ROOT )?%(\w*fusion[\w.]*) = ", module, re.M)]
    assert any(re.search(r"_\d+$", kernel) for kernel in kernels)  # fusion.1 runs as kernel fusion_1 (two GELUs)
    sources = load_script("profile_jax_cycle").kernel_sources([*kernels, "decode_attention_partials"], tmp_path)
    gelu_line = inspect.getsourcelines(gemma_jax._gelu)[1] + 1  # its body's one line
    assert set(sources) == set(kernels)  # a name the module does not define is left out
    assert any("tanh" in found["ops"] and f"gemma_jax.py:{gelu_line}:_gelu" in found["sources"]
               for found in sources.values()), sources


def test_host_events_are_counted_per_call():
    """host_events on CPU traces of 4 and of 8 calls of a jitted function: its dispatch events (jax traces two,
    nested, a call) come out as many per call, whatever the calls."""
    import jax
    import jax.numpy as jnp

    script = load_script("profile_jax_cycle")
    double = jax.jit(lambda x: x * 2)
    x = jnp.ones(8)
    double(x).block_until_ready()
    per_call = []
    for calls in (4, 8):
        profile, _ = script.traced(lambda: [double(x).block_until_ready() for _ in range(calls)])
        events = script.host_events(profile, calls, top=1000)
        [dispatch] = [e for e in events if e["name"] == "PjitFunction(<lambda>)"]
        assert dispatch["ms"] > 0
        per_call.append(dispatch["per_call"])
        assert all(not re.search(r"/-?\d+$", e["thread"]) for e in events)  # threads by kind, not by id
    assert per_call[0] == per_call[1] >= 1
