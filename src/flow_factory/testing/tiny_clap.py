"""A tiny ClapModel and processor built from config, saved with ``save_pretrained`` so that the ``clap``
reward's tests load them through the same ``from_pretrained`` path as LAION's checkpoints."""

from __future__ import annotations

from pathlib import Path

from .tiny import _byte_symbols


def tiny_roberta_tokenizer():
    """Byte-level RoBERTa tokenizer (CLAP's text side): 256 byte symbols and RoBERTa's specials, no merges."""
    from transformers import RobertaTokenizer

    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    for special in ("<s>", "<pad>", "</s>", "<unk>", "<mask>"):
        vocab[special] = len(vocab)
    return RobertaTokenizer(vocab=vocab, merges=[])


def build_tiny_clap(path, seed: int = 0) -> Path:
    """Write a random-init ClapModel (one-layer text model, a two-stage HTSAT on CLAP's 64 mel bins, projection
    16) and its ClapProcessor (48 kHz, 10 s, no fusion) to ``path``; returns the folder."""
    import torch
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor

    tokenizer = tiny_roberta_tokenizer()
    # RoBERTa's position ids start after the pad id, so the table must reach past it
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=len(tokenizer) + 80, projection_dim=16,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)
    # spec_size 256 over 64 mel bins: the 1001 frames of 10 s at hop 480 fit, as in the released models
    audio = dict(depths=[1, 1], num_attention_heads=[2, 2], hidden_size=32, patch_embeds_hidden_size=16,
                 projection_hidden_size=32, projection_dim=16, window_size=8, spec_size=256, num_mel_bins=64)
    torch.manual_seed(seed)
    model = ClapModel(ClapConfig(text_config=text, audio_config=audio, projection_dim=16)).eval()
    processor = ClapProcessor(feature_extractor=ClapFeatureExtractor(truncation="rand_trunc"), tokenizer=tokenizer)
    path = Path(path)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
