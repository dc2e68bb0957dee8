"""User-facing applications on trained directories: evaluate, ask, and the end-to-end demo."""
