"""kvpilot.kernels"""
