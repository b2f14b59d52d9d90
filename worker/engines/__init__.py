"""worker/engines"""
