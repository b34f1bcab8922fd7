"""HTTP controllers: thin handlers that call services."""
