"""Real JPEG and MP4 files -> our processing, chat and positions -> our model,
against transformers' image processor, rope index and model on the same files."""

import dataclasses

import av
import numpy as np
import pytest
from PIL import Image, ImageDraw

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fluxjax.models import hf_load, inputs, media, processor  # noqa: E402
from fluxjax.models.tokenizer import Tokenizer  # noqa: E402
from hf_peer import TOL, random_hf_model  # noqa: E402


def _draw(width, height, shapes, seed):
  rng = np.random.default_rng(seed)
  img = Image.new("RGB", (width, height), (240, 240, 240))
  draw = ImageDraw.Draw(img)
  for _ in range(shapes):
    x, y = rng.integers(0, width - 20), rng.integers(0, height - 20)
    colour = tuple(int(c) for c in rng.integers(0, 255, 3))
    draw.ellipse([x, y, x + 18, y + 18], fill=colour)
  return img


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  folder = tmp_path_factory.mktemp("media")
  image_path = folder / "shapes.jpg"
  _draw(200, 150, 6, 0).save(image_path, quality=90)
  video_path = folder / "clip.mp4"
  with av.open(str(video_path), "w") as out:
    stream = out.add_stream("libx264", rate=4)
    stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
    for i in range(8):
      frame = av.VideoFrame.from_image(_draw(96, 64, 3, i + 1))
      for packet in stream.encode(frame):
        out.mux(packet)
    for packet in stream.encode():
      out.mux(packet)
  return image_path, video_path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  hf = random_hf_model(seed=11)
  folder = tmp_path_factory.mktemp("ckpt")
  hf.save_pretrained(folder)
  # Compare positions under transformers' rule; the default (SGLang's) rule is
  # tested separately in test_rope_index.py.
  ours = hf_load.load_hf_checkpoint(str(folder))
  ours.cfg = dataclasses.replace(ours.cfg, mrope_text_after_vision="grid_extent")
  return hf, ours


def test_files_to_logits_match_transformers(files, models):
  image_path, video_path = files
  hf, ours = models
  cfg = processor.VisionProcessorConfig()
  image = media.load_image(image_path)
  frames, fps = media.load_video(video_path, cfg)
  img = processor.preprocess_image(image, cfg)
  vid = processor.preprocess_video(frames, cfg, fps)
  messages = [
    {
      "role": "user",
      "content": [
        {"type": "image"},
        {"type": "text", "text": "How many circles are there?"},
        {"type": "video"},
        {"type": "text", "text": "Which colour appears last?"},
      ],
    }
  ]
  seq = inputs.sequence_from_chat(messages, [img, vid], Tokenizer.default(), ours.cfg)
  row = inputs.pack_row(
    [seq], ours.cfg, token_capacity=len(seq) + 7, patch_capacity=seq.num_patches + 12
  )
  got = np.asarray(ours.logits(row))[0, : len(seq)]

  # The peer: HF's own image processor on the same decoded image, HF's rope
  # index from mm_token_type_ids. (HF's video processor needs torchvision, which
  # has no CPU build here, so the video patches are ours: test_processor checks
  # them against the video processor's source.)
  hf_image = transformers.Qwen2VLImageProcessorPil()(images=[image], return_tensors="np")
  np.testing.assert_allclose(hf_image["pixel_values"], img.patches, atol=1e-5, rtol=0)
  types = np.where(
    seq.tokens_T == ours.cfg.image_token_id,
    1,
    np.where(seq.tokens_T == ours.cfg.video_token_id, 2, 0),
  )
  kw = dict(
    input_ids=torch.tensor(seq.tokens_T[None], dtype=torch.long),
    mm_token_type_ids=torch.tensor(types[None]),
    pixel_values=torch.tensor(hf_image["pixel_values"]),
    image_grid_thw=torch.tensor(hf_image["image_grid_thw"]),
    pixel_values_videos=torch.tensor(vid.patches),
    video_grid_thw=torch.tensor([vid.grid_thw]),
    second_per_grid_ts=torch.tensor([vid.second_per_grid]),
  )
  with torch.no_grad():
    hf_pos = hf.model.get_rope_index(
      kw["input_ids"],
      kw["mm_token_type_ids"],
      kw["image_grid_thw"],
      kw["video_grid_thw"],
      kw["second_per_grid_ts"],
    )[0][:, 0].numpy()
    want = hf(**kw).logits[0].numpy()
  np.testing.assert_array_equal(seq.positions_3T, hf_pos)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_response_positions_continue_the_prompt(files, models):
  """A sampled response appended with `extend` equals one forward over both."""
  image_path, _ = files
  _, ours = models
  img = processor.preprocess_image(media.load_image(image_path), processor.VisionProcessorConfig())
  messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}]
  tok = Tokenizer.default()
  prompt = inputs.sequence_from_chat(messages, [img], tok, ours.cfg)
  response = tok.encode(" 3<|im_end|>")
  full = prompt.extend(response)
  again = inputs.sequence_from_tokens(full.tokens_T, [img], ours.cfg)
  np.testing.assert_array_equal(full.positions_3T, again.positions_3T)


def test_media_out_of_order_is_an_error(files, models):
  image_path, video_path = files
  _, ours = models
  cfg = processor.VisionProcessorConfig()
  img = processor.preprocess_image(media.load_image(image_path), cfg)
  frames, fps = media.load_video(video_path, cfg)
  vid = processor.preprocess_video(frames, cfg, fps)
  messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}]}]
  seq = inputs.sequence_from_chat(messages, [img, vid], Tokenizer.default(), ours.cfg)
  with pytest.raises(ValueError, match="order"):
    inputs.sequence_from_tokens(seq.tokens_T, [vid, img], ours.cfg)
