"""The ring protocol: layout (numpy dtypes), ring geometry, generated CUDA header, transports, wire types.

Imports only the standard library, numpy and msgspec (architecture rule 3).
"""
