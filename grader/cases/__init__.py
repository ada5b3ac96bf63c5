"""One module per week; each registers its cases on import."""
