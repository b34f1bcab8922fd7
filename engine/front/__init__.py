"""The front ends: the engine's step loop in a background thread (``AsyncLLMEngine``) or a supervised child
process (``ProcessLLMEngine``) over pipes, and the per-request streams they hand out."""
