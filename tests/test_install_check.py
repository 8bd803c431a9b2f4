"""python -m fluxjax.install_check: what a GPU run lacks, named with its fix."""

from fluxjax import install_check

READY = {
  "jax": "0.11.2",
  "jax CUDA 12 plugin": "0.11.2",
  "torch": "2.9.1",
  "sglang": "0.5.6",
  "sglang-router": "0.3.2",
  "torch CUDA": "12.6",
  "torch NCCL": True,
}


def test_each_missing_piece_is_named_with_its_fix():
  assert install_check.problems(READY, "distributed", sglang=True) == []
  cpu = {**READY, "jax CUDA 12 plugin": None, "torch": "2.9.1+cpu", "torch CUDA": None}
  cpu["torch NCCL"] = False
  got = install_check.problems(cpu, "distributed", sglang=False)
  assert got[0].startswith("JAX has no CUDA plugin")
  assert "pip install torch==2.9.1 --index-url" in got[1] and "CPU build" in got[1]
  assert len(install_check.problems(cpu, "disk", sglang=False)) == 1  # disk needs no NCCL
  none = {**READY, "sglang": None, "sglang-router": None}
  assert [p.split(":")[0] for p in install_check.problems(none, "disk", sglang=True)] == [
    "no sglang",
    "no sglang-router",
  ]


def test_this_cpu_machine_is_not_ready_and_says_why(capsys):
  assert install_check.main(["--weight-sync", "distributed"]) == 1
  out = capsys.readouterr().out
  assert "missing: JAX has no CUDA plugin" in out and "CPU build" in out
  assert out.strip().splitlines()[-1].startswith("not ready")
