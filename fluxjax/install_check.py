r"""Is this environment ready for a GPU run? python -m fluxjax.install_check.

  python -m fluxjax.install_check [--weight-sync distributed] [--sglang]

Reads installed packages only: it needs no GPU and starts nothing. It reports JAX and its
CUDA plugin, torch and whether it can speak NCCL (what `rollout.weight_sync=distributed`
on GPUs needs), SGLang and the sglang-router, and exits 1 naming what is missing for the
modes asked for. The GPU install: docs/quickstart-gpu.md, "Install".
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

# The SGLang HTTP API the fleet client speaks (docs/fleet.md, "The server's API").
SGLANG_API = "0.5"


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def findings() -> dict[str, str | bool | None]:
  """What is installed: versions (None: absent) and torch's CUDA and NCCL."""
  out: dict[str, str | bool | None] = {
    "jax": _version("jax"),
    "jax CUDA 12 plugin": _version("jax-cuda12-plugin"),
    "torch": _version("torch"),
    "sglang": _version("sglang"),
    "sglang-router": _version("sglang-router"),
  }
  out["torch CUDA"] = out["torch NCCL"] = None
  if out["torch"]:
    import torch
    import torch.distributed

    out["torch CUDA"] = torch.version.cuda
    out["torch NCCL"] = torch.distributed.is_available() and torch.distributed.is_nccl_available()
  return out


def problems(found: dict, weight_sync: str, sglang: bool) -> list[str]:
  """What is missing for a GPU run in these modes, each with its fix."""
  out = []
  if not found["jax CUDA 12 plugin"]:
    out.append("JAX has no CUDA plugin: pip install -c constraints.txt -e '.[cuda]'")
  if weight_sync == "distributed":
    if not found["torch"]:
      out.append(
        "weight_sync=distributed needs torch: pip install -c constraints.txt -e '.[weight-sync]'"
      )
    elif not (found["torch CUDA"] and found["torch NCCL"]):
      base = str(found["torch"]).split("+")[0]  # 2.9.1+cpu -> 2.9.1
      out.append(
        f"torch {found['torch']} is a CPU build (no NCCL): pip install torch=={base} "
        "--index-url https://download.pytorch.org/whl/cu128 (the CUDA build your driver takes; "
        "or weight_sync=disk)"
      )
  if sglang:
    if not found["sglang"]:
      out.append(f"no sglang: pip install 'sglang>={SGLANG_API}' (in the servers' environment)")
    if not found["sglang-router"]:
      out.append("no sglang-router: pip install -c constraints.txt -e '.[fleet]'")
  return out


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--weight-sync", choices=("disk", "distributed"), default="disk")
  p.add_argument("--sglang", action="store_true", help="the servers run in this environment")
  args = p.parse_args(argv)
  found = findings()
  for name, value in found.items():
    print(f"{name:20s} {value if value not in (None, '') else 'absent'}")
  missing = problems(found, args.weight_sync, args.sglang)
  for line in missing:
    print(f"missing: {line}")
  print("ready" if not missing else f"not ready: {len(missing)} missing")
  return 1 if missing else 0


if __name__ == "__main__":
  sys.exit(main())
