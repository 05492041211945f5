"""Hot loops in Cython: the token radix tree with eviction, and the router's character tree.

Every ``*.pyx`` file in this folder is compiled by ``setup.py`` into ``kvroute.cython_ext.<name>``.
Nothing here imports other kvroute packages.
"""
