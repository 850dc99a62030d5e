"""Tiny random Wan assets on disk, built offline: a diffusers-format Wan transformer, an AutoencoderKLWan, a
umT5 encoder and a word-level tokenizer (folders laid out as a Wan diffusers checkpoint's), and a video folder
of clips written with write_mp4. Shapes: clips of 5 frames of 16 x 16 -> latents (4, 3, 8, 8) (the tiny VAE
halves time and space once); captions -> 8 tokens of width 16."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megaslide.data.video_io import write_mp4

FRAMES, SIZE, TEXT_LEN, TEXT_DIM, Z = 5, 16, 8, 16, 4
WORDS = ["a", "red", "blue", "circle", "square", "moving", "left", "right", "up", "down"]


def write_checkpoint(root: Path) -> Path:
    """root/{transformer, vae, text_encoder, tokenizer}: a Wan diffusers checkpoint of tiny random parts."""
    import diffusers
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    torch.manual_seed(0)
    wan = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                          in_channels=Z, out_channels=Z, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32,
                                          num_layers=2, rope_max_seq_len=32)
    wan.save_pretrained(root / "transformer")
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=Z, dim_mult=[1, 1], num_res_blocks=1,
                                     temperal_downsample=[True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                                     latents_std=[1.5, 0.5, 1.0, 2.0])
    vae.save_pretrained(root / "vae")
    umt5 = transformers.UMT5EncoderModel(transformers.UMT5Config(vocab_size=len(WORDS) + 3, d_model=TEXT_DIM, d_kv=8,
                                                                 d_ff=32, num_layers=1, num_heads=2))
    umt5.save_pretrained(root / "text_encoder")
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])  # as umT5's
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(root / "tokenizer")
    return root


def write_clips(root: Path, captions: list[str], frames: int = FRAMES, size: tuple[int, int] = (SIZE, SIZE)) -> Path:
    """A video folder: one moving-gradient mp4 per caption and captions.jsonl."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, caption in enumerate(captions):
        t = torch.linspace(-1, 1, frames).view(frames, 1, 1)
        y = torch.linspace(-1, 1, size[0]).view(1, size[0], 1)
        x = torch.linspace(-1, 1, size[1]).view(1, 1, size[1])
        zero = torch.zeros(frames, *size)
        video = torch.stack([torch.sin(3 * (x + t + i)) + zero, y + zero, x * y + zero])  # (3, T, H, W)
        write_mp4(root / f"clip{i}.mp4", video.clamp(-1, 1))
        lines.append(json.dumps({"file": f"clip{i}.mp4", "caption": caption}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return root
