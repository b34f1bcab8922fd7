"""kvgate gateway: the OpenAI-compatible HTTPS API, tenants, admission and the CLI."""
