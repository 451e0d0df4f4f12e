"""The ring protocol: layout (numpy dtypes), generated CUDA header, transports, wire types.

Imports only the standard library, numpy and msgspec (architecture rule 3).
"""
