"""Caches of computed state: the prefix trie in RAM, sessions on disk, and mlx-lm's prompt caches."""
