"""Thin adapters from gradhealth to training frameworks and loggers.

Each adapter imports its framework at the top; the core (``gradhealth``) never imports these.
"""
