"""The distributed transport's layout: whose ranks are where in the update
group, and how the model is cut into update calls."""

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given

from fluxjax.models import config, hf_export
from fluxjax.rollout import publish, weight_group


def test_each_server_gets_as_many_ranks_as_it_has_gpus():
  # The trainer is rank 0; a tp-8 server takes 8 ranks, as in SGLang's update group.
  assert publish.rank_layout([1, 8, 2]) == ([1, 2, 10], 12)
  assert publish.rank_layout([1, 1]) == ([1, 2], 3)
  with pytest.raises(ValueError, match="at least one rank"):
    publish.rank_layout([1, 0])


@given(st.lists(st.integers(0, 6000), max_size=30), st.integers(1, 5000))
def test_byte_runs_cover_every_tensor_in_order_within_the_cap(nbytes, max_bytes):
  runs = hf_export.byte_runs(nbytes, max_bytes)
  assert [i for run in runs for i in run] == list(range(len(nbytes)))
  sizes = [[nbytes[i] for i in run] for run in runs]
  for run in sizes:
    assert sum(run) <= max_bytes or len(run) == 1  # only a tensor over the cap goes alone
  for this, following in itertools.pairwise(sizes):  # closed only where the next would overflow
    assert sum(this) + following[0] > max_bytes


def test_the_7b_model_goes_in_buckets_of_at_most_512_mib():
  sizes = [n for _, n in hf_export.tensor_bytes(config.preset("7b"), "bfloat16")]
  cap = 512 * 2**20
  runs = hf_export.byte_runs(sizes, cap)
  assert max(sizes) > cap and len(runs) > 16  # the embedding, 1.09 GB in bf16
  assert all(sum(sizes[i] for i in run) <= cap for run in runs if len(run) > 1)


def test_nccl_broadcasts_gpu_tensors_gloo_cpu_ones():
  assert weight_group.tensor_device("nccl") == "cuda"
  assert weight_group.tensor_device("gloo") == "cpu"
