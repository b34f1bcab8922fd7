"""Alembic migrations for the gateway database."""
