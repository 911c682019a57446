"""The gvisor backend: every sandbox is a gVisor (runsc) sandbox; see backend.py."""
