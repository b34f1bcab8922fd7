"""Persistence: ORM models, the async engine/sessionmaker, repositories and migrations."""
