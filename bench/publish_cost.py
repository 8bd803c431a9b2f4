"""bench/publish.py's cost model: what each transport costs a Qwen2.5-VL-7B or
32B trainer on N hosts publishing to S servers, from assumed bandwidths.

Per transport: blocked undeferred, blocked deferred (the gathers, the
trainer's own work), what a deferred publish runs beside the next step (the
write or the send, which that step's wait for rollouts must cover, or its
update waits for the rest), and the servers' pause. The baseline gathers the
fp32 model onto every host (twice the bf16 bytes, and the whole fp32 model
held per host) and writes the whole folder from one. The others gather each
layer tensor in bf16 to the process that consumes it, past
hf_export.ROW_RUN_BYTES in runs of rows (each writer receives (N-1)/N of its
own 1/N of the bf16 model, the broadcast's process 0 (N-1)/N of all of it)
and hold at most one run, but for the broadcast's process 0, which holds the
largest tensor whole (the protocol sends it so); the disk path then writes
1/N of the folder from each host at once and every server reads the folder;
with deltas each host also reads its own files of the previous version back
and writes 6 bytes per changed element (`--changed-share` of them), and the
servers read only those; the broadcast sends each byte once down a
pipelined NCCL tree from process 0.
"""

from __future__ import annotations

import numpy as np

from fluxjax.models import config, hf_export, hf_load

# Parameters in bf16 of the published models (Qwen2.5-VL, LM and vision tower).
PROJECTED = {"7b": 8.29e9, "32b": 33.5e9}


def projection(args) -> list[dict]:
  """Seconds each transport takes for the published models (module docstring)."""
  rows = []
  largest = {  # the largest tensor in bf16: what a broadcast adds to a host
    name: 2 * max(int(np.prod(shape)) for _, shape in hf_load.hf_layout(config.preset(name)))
    for name in PROJECTED
  }
  # The disk path takes a tensor past hf_export.ROW_RUN_BYTES in runs of rows.
  disk_largest = {name: min(n, hf_export.ROW_RUN_BYTES) for name, n in largest.items()}
  for name, params in PROJECTED.items():
    bf16 = 2 * params
    for hosts in (1, 2, 4, 16):
      for servers in (1, 8, 32):
        # An all-gather brings each host the other hosts' part of every tensor;
        # to the owner, a writer gets the others' part of its own files (1/N
        # of the model) and the broadcast's process 0 theirs of every tensor.
        allgather = bf16 * (hosts - 1) / hosts / args.net_gbps / 1e9 if hosts > 1 else 0.0
        to_writer, to_leader = allgather / hosts, allgather
        write = bf16 / hosts / args.disk_write_gbps / 1e9  # each host its own files
        read = bf16 * servers / min(args.fs_read_gbps, servers * args.disk_read_gbps) / 1e9
        send = bf16 / args.net_gbps / 1e9  # pipelined: each byte crosses each link once
        # Deltas: 6 bytes (int32 index + bf16 value) per changed element; each
        # host also reads its own files of the base back.
        delta = 3 * args.changed_share * bf16
        base = bf16 / hosts / args.disk_read_gbps / 1e9
        delta_read = delta * servers / min(args.fs_read_gbps, servers * args.disk_read_gbps) / 1e9
        delta_write = delta / hosts / args.disk_write_gbps / 1e9
        # The baseline: every host receives the rest of the fp32 model, then
        # process 0 alone writes the whole bf16 folder.
        gather_fp32 = 2 * allgather
        rows.append(
          {
            "model": name,
            "hosts": hosts,
            "servers": servers,
            "gather0_blocked_s": gather_fp32 + bf16 / args.disk_write_gbps / 1e9 + read,
            "gather0_extra_bytes_per_host": 2 * bf16,  # the whole fp32 model on every host
            "disk_blocked_s": to_writer + write + read,
            "disk_paused_s": read,
            # Deferred, the trainer's main thread runs the gathers; the rest
            # runs beside the next step, whose wait for rollouts must cover it.
            "disk_deferred_blocked_s": to_writer,
            "disk_beside_step_s": write,
            "disk_extra_bytes_per_host": disk_largest[name],
            "delta_blocked_s": to_writer + write + base + delta_write + delta_read,
            "delta_paused_s": delta_read,
            "delta_deferred_blocked_s": to_writer,
            "delta_beside_step_s": write + base + delta_write,
            "distributed_blocked_s": to_leader + send,
            "distributed_paused_s": send,
            "distributed_deferred_blocked_s": to_leader,
            "distributed_beside_step_s": send,
            "distributed_extra_bytes_per_host": largest[name],
          }
        )
  return rows


def print_projection(rows: list[dict]) -> None:
  """The cost model's table at 8 servers and 1, 4 and 16 hosts."""
  print("\ncost model (seconds; --net-gbps etc.):")
  cols = ["gather0_blocked_s"] + [
    f"{t}_{k}"
    for t in ("disk", "delta", "distributed")
    for k in ("blocked_s", "deferred_blocked_s", "beside_step_s", "paused_s")
  ]
  print("| model | hosts | servers | " + " | ".join(c.removesuffix("_s") for c in cols) + " |")
  print("|---|---|---|" + "---|" * len(cols))
  for row in rows:
    if row["servers"] == 8 and row["hosts"] in (1, 4, 16):
      cells = " | ".join(f"{row[c]:.2f}" for c in cols)
      print(f"| {row['model']} | {row['hosts']} | {row['servers']} | {cells} |")
