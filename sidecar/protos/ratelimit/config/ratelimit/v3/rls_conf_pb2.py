# Emitted by scripts/vendor_envoy_protos.py from its rls_conf_descriptor(): do not edit.
# source: ratelimit/config/ratelimit/v3/rls_conf.proto (the reference's xDS resource)
"""Generated protocol buffer code."""
from google.protobuf import descriptor_pool as _descriptor_pool
from google.protobuf.internal import builder as _builder

DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(b'\n,ratelimit/config/ratelimit/v3/rls_conf.proto\x12\x1dratelimit.config.ratelimit.v3"\x93\x01\n\x0fRateLimitConfig\x12\x12\n\x04name\x18\x01 \x01(\tR\x04name\x12\x16\n\x06domain\x18\x02 \x01(\tR\x06domain\x12T\n\x0bdescriptors\x18\x03 \x03(\x0b22.ratelimit.config.ratelimit.v3.RateLimitDescriptorR\x0bdescriptors"\x83\x02\n\x13RateLimitDescriptor\x12\x10\n\x03key\x18\x01 \x01(\tR\x03key\x12\x14\n\x05value\x18\x02 \x01(\tR\x05value\x12M\n\nrate_limit\x18\x03 \x01(\x0b2..ratelimit.config.ratelimit.v3.RateLimitPolicyR\trateLimit\x12T\n\x0bdescriptors\x18\x04 \x03(\x0b22.ratelimit.config.ratelimit.v3.RateLimitDescriptorR\x0bdescriptors\x12\x1f\n\x0bshadow_mode\x18\x05 \x01(\x08R\nshadowMode"\xfe\x01\n\x0fRateLimitPolicy\x12@\n\x04unit\x18\x01 \x01(\x0e2,.ratelimit.config.ratelimit.v3.RateLimitUnitR\x04unit\x12*\n\x11requests_per_unit\x18\x02 \x01(\rR\x0frequestsPerUnit\x12\x1c\n\tunlimited\x18\x03 \x01(\x08R\tunlimited\x12\x12\n\x04name\x18\x04 \x01(\tR\x04name\x12K\n\x08replaces\x18\x05 \x03(\x0b2/.ratelimit.config.ratelimit.v3.RateLimitReplaceR\x08replaces"&\n\x10RateLimitReplace\x12\x12\n\x04name\x18\x01 \x01(\tR\x04name*G\n\rRateLimitUnit\x12\x0b\n\x07UNKNOWN\x10\x00\x12\n\n\x06SECOND\x10\x01\x12\n\n\x06MINUTE\x10\x02\x12\x08\n\x04HOUR\x10\x03\x12\x07\n\x03DAY\x10\x04b\x06proto3')
_globals = globals()
_builder.BuildMessageAndEnumDescriptors(DESCRIPTOR, _globals)
_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, "sidecar.protos.ratelimit.config.ratelimit.v3.rls_conf_pb2", _globals)
