"""One process of a jax.distributed (multi-controller) engine run: `python dist_worker.py PID N PORT`.

Every process runs the same scheduler over the same requests (deterministic), and the programs span the global
mesh of all processes' devices. Prints one RESULT line of JSON."""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

pid, n, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_default_matmul_precision", "highest")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=pid)
sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]  # its test, tests/
from engine_util import engine, prompts  # noqa: E402
from test_engine_sharded import eight_head_model  # noqa: E402
from jaxserve.engine import SamplingParams  # noqa: E402

e = engine(eight_head_model("deepseek_v3"), devices=len(jax.devices()))
out = [o.token_ids for o in e.generate(prompts(3), SamplingParams(max_tokens=6, ignore_eos=True))]
print("RESULT", json.dumps({"pid": pid, "devices": len(jax.devices()), "local": len(jax.local_devices()),
                            "tokens": out}), flush=True)
jax.distributed.shutdown()
