"""Structured outputs' machinery: grammars compiled off the step path, their next-token masks computed in
worker threads shared fairly by tenants, requests waiting for their grammar, and the cost checks done
before a grammar is built."""
