"""Rewards from a vision-language model behind an OpenAI-compatible API (vLLM, SGLang, ...)."""
