"""Templates from environments users bring: OCI images imported into a content-addressed layer store.

refs.py      what an image reference names (skopeo's transports) and whether the operator allows it
fetch.py     skopeo copies an image into a private OCI layout (it verifies every blob's digest)
layout.py    reading that layout: the manifest, the config, the layers and their sizes
unpack.py    one layer's tar unpacked into its own directory, hostile archives refused
store.py     the layers (each stored once, by its uncompressed digest), the templates naming them, GC
importer.py  the import itself: policy, fetch, size ceiling, unpack, commit

docs/dev-notes/oci-import.md says what exists and what running sandboxes from a template still needs.
"""
