-- The tenant registry (the one key outside a tenant's slot). KEYS[1] = P:tenants; ARGV: tag, tenant,
-- retention ms. -> 1
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
