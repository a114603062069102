"""Construction: kernel descriptions to validated job programs for the card.

This is the work the dispatch modes move: ``construct`` runs it on every launch,
``prebuilt`` once, when the graph plan is built.
"""
