"""Pydantic request/response models at the HTTP edge (frozen, extra="forbid")."""
