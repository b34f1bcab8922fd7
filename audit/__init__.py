"""Redacted structured logging, the tamper-evident audit trail and signed exports."""
