"""Routing: which series go to which model and where results go (rules, destinations). It owns
those decisions; it must not store or send anything.
"""
