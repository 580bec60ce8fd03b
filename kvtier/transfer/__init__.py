"""The transfer engine: page copies between device memory and host staging buffers."""
