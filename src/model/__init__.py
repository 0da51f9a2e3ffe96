"""The model.

The Trax ReformerLM, the gin configurables it is built from, and the memory
pre-flight.
"""
