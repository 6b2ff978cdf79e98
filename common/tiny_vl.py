"""A tiny Qwen2-VL model directory, served at random weights (``random:qwen2-vl-tiny``).

It makes the image path of the Salience API real without any downloaded weights: the config is
transformers' Qwen2-VL architecture shrunk to a few layers and a small hidden size, the tokenizer
is the embedded SmolLM2 one with Qwen2-VL's four vision tokens added, and the image processor
config is Qwen2-VL's own (14-pixel patches, 2×2 merge), so feature counts are the real
processor's: a 224×224 image is a 16×16 patch grid, 64 ``<|image_pad|>`` tokens.

The directory is written once into ``cache_dir`` (under a file lock: several processes may ask
at once) and is an ordinary Hugging Face model directory from then on.
"""

from __future__ import annotations

import json
from pathlib import Path

from filelock import FileLock

NAME = "qwen2-vl-tiny"
VERSION = 1  # bump when the files written below change: a new cache directory is used

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL's processor settings, with max_pixels lowered so one image stays within a few
# hundred tokens of the tiny model's context.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 56 * 56,
    "max_pixels": 448 * 448,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def _config(vocab_size: int, token_ids: dict[str, int], eos: int | None) -> dict[str, object]:
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2
            "bos_token_id": None,
            "eos_token_id": eos,
            # wide initial weights: a random model at the default 0.02 repeats its last token whatever
            # the input, which would hide whether an image reached it
            "initializer_range": 0.5,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,  # the merger's output: the text model's hidden size
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": PREPROCESSOR["patch_size"],
            "spatial_merge_size": PREPROCESSOR["merge_size"],
            "temporal_patch_size": PREPROCESSOR["temporal_patch_size"],
            "initializer_range": 0.5,
        },
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    data = config.to_dict()
    data["architectures"] = ["Qwen2VLForConditionalGeneration"]
    data.pop("_name_or_path", None)
    return data


def cache_name() -> str:
    return f"{NAME}-v{VERSION}"


def prepare(cache_dir: Path, base_tokenizer_dir: Path) -> Path:
    """Write (once) and return the tiny Qwen2-VL directory; ``base_tokenizer_dir`` holds the
    SmolLM2 tokenizer it extends."""
    target = cache_dir / cache_name()
    target.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base_tokenizer_dir)
        tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
        tokenizer.save_pretrained(target)
        token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        (target / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
        config = _config(len(tokenizer), token_ids, tokenizer.eos_token_id)
        (target / "config.json").write_text(json.dumps(config, indent=2))  # last: marks the directory complete
    return target
