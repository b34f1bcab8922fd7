"""Upstream pools: served models whose requests go to vLLM, SGLang, llama.cpp or another kvgate."""
