"""Rendering a data directory for people: text tables for the CLI (`display`), SVG
charts (`charts`), the HTML training report (`report`) and the web view (`web`).

Reads through `storage`; imports neither the proxy, the judge nor the trainer, so the
CLI and the proxy both use it.
"""
