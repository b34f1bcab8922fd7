"""The inference path: admitting an OpenAI request (limits, tokens, policy, quota), running it on the
engine, formatting its replies and settling it once, with its receipt and optional retention."""
