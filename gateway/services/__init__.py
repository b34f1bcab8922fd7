"""Business logic over the repositories; controllers stay two or three lines."""
