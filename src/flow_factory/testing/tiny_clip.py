"""A tiny CLIPModel and processor built from config, saved with ``save_pretrained`` so that
reward tests load them through the same ``from_pretrained`` path as real checkpoints."""

from __future__ import annotations

from pathlib import Path

from .tiny import tiny_clip_tokenizer


def build_tiny_clip(path, seed: int = 0) -> Path:
    """Write a random-init CLIPModel (vision 32x32, patch 8, projection 16) and its
    CLIPProcessor to ``path``; returns the folder."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = tiny_clip_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                  image_size=32, patch_size=8)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer)
    path = Path(path)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
