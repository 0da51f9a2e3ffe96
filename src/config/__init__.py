"""Settings.

The JSON config file's sections and the restricted gin reader.
"""
