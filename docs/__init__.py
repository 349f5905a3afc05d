"""The documentation site's pages (Markdown, built by MkDocs) and the script that writes
the configuration reference (config_reference.py)."""
