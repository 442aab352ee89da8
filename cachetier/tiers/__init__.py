"""Tier implementations behind the one ``Tier`` interface."""
