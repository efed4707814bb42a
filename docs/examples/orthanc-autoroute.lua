-- Orthanc auto-routing to segnode: forward every stable CT series, whole, in one association.
--
-- Orthanc calls OnStableSeries once a series has received no new instance for "StableAge"
-- seconds (Orthanc configuration). SendToModality(seriesId, ...) then sends all instances of
-- the series over ONE association, so segnode completes the series when that association is
-- released and never sees a partial series. (Forwarding from OnStoredInstance instead would
-- send instance by instance, and segnode could complete the series after the first one.)
--
-- Only Modality CT is forwarded. segnode's own results (Modality SEG and SR) therefore stay in
-- Orthanc and cannot loop; segnode's loop guard would ignore them anyway. Localizers are CT
-- too: segnode's routing rules record them as ignored, with the reason.

local SEGNODE = 'SEGNODE'  -- the node's key in Orthanc's "DicomModalities"

function OnStableSeries(seriesId, tags, metadata)
  if tags['Modality'] == 'CT' then
    print('segnode auto-routing: forwarding CT series ' .. seriesId)
    -- An asynchronous C-STORE job over one association for the whole series (the Lua
    -- SendToModality() command works instance by instance).
    local job = {Resources = {seriesId}, Asynchronous = true}
    RestApiPost('/modalities/' .. SEGNODE .. '/store', DumpJson(job, true))
  end
end
